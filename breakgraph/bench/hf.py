"""``bench step``'s HF transformers arms: the engine's model built by transformers on the same
shapes (sdpa attention), eager and under ``torch.compile(mode="reduce-overhead")``."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class HFArms:
    """The HF transformers twin of the engine's model: its config, random weights."""

    def __init__(self, engine, compile_timeout_s: float):
        try:
            import transformers
        except ImportError:
            raise ImportError(
                "the HF arms need transformers: pip install 'breakgraph[bench]'"
            ) from None

        cfg = dict(engine.model_config.raw)
        cfg.setdefault("torch_dtype", "bfloat16")
        arch = engine.model_config.architecture
        model_type = cfg.pop("model_type", None) or arch_model_type(arch)
        config = transformers.AutoConfig.for_model(model_type, **cfg)
        config._attn_implementation = "sdpa"
        # built in the engine's dtype on the device: a float32 copy first would not fit
        # beside the engine's weights for a large model (the 30B MoE's 61 GB in bf16)
        with torch.device(engine.device):
            self.model = getattr(transformers, arch)._from_config(config, dtype=engine.dtype)
        self.model.eval()
        experts = getattr(self.model.config, "_experts_implementation", None)
        if experts is not None and getattr(self.model.config, "num_experts", None):
            print(f"HF experts implementation: {experts}", flush=True)
        self.device = engine.device
        vocab = engine.vocab_size
        self.id_range = (min(1000, vocab // 2), min(30000, vocab - 1))  # as StepBench's
        self.compile_timeout_s = compile_timeout_s
        self.compiled = None

    def inputs(self, new_tokens: int, prefix_tokens: int):
        from transformers import DynamicCache

        g = torch.Generator().manual_seed(new_tokens)
        ids = torch.randint(*self.id_range, (1, new_tokens), generator=g).to(self.device)
        cache = None
        if prefix_tokens:
            cache = DynamicCache(config=self.model.config)
            with torch.inference_mode():
                pre = torch.randint(*self.id_range, (1, prefix_tokens), generator=g).to(self.device)
                self.model(pre, past_key_values=cache, use_cache=True)
        return ids, cache

    def eager_fn(self, new_tokens: int, prefix_tokens: int):
        ids, cache = self.inputs(new_tokens, prefix_tokens)

        def run():
            with torch.inference_mode():
                out = self.model(
                    ids, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1
                )
            if cache is not None:
                cache.crop(-new_tokens)  # drop what this step appended
            return out.logits

        return run

    def compiled_fn(self, new_tokens: int) -> tuple[Callable[[], object] | None, str]:
        """torch.compile(reduce-overhead) at P=0; None with a reason if it does not compile in time."""
        if self.compiled is None:
            self.compiled = torch.compile(self.model, mode="reduce-overhead")
        ids, _ = self.inputs(new_tokens, 0)

        def run():
            with torch.inference_mode():
                return self.compiled(ids, use_cache=False, logits_to_keep=1).logits

        t0 = time.perf_counter()
        try:
            for _ in range(3):  # compile, record, then replay
                run()
                if time.perf_counter() - t0 > self.compile_timeout_s:
                    return None, f"did not compile within {self.compile_timeout_s:.0f} s"
        except Exception as e:  # noqa: BLE001 - a compile failure is a result to report
            return None, f"compile failed: {type(e).__name__}: {str(e)[:80]}"
        return run, f"compiled in {time.perf_counter() - t0:.0f} s"


def arch_model_type(arch: str) -> str:
    return {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[
        arch
    ]
