"""OpenAI-compatible routes: /v1/models here, /v1/completions (openai_completions.py) and
/v1/chat/completions (openai_chat.py)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from breakgraph.server.openai_chat import chat_completions
from breakgraph.server.openai_completions import completions
from breakgraph.server.state import server_state

router = APIRouter(prefix="/v1")
router.add_api_route("/completions", completions, methods=["POST"])
router.add_api_route("/chat/completions", chat_completions, methods=["POST"])


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    s = server_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": s.served_model_name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "breakgraph",
                "root": s.model_path or s.info.model_source,
                "max_model_len": s.info.context_length,
            }
        ],
    }
