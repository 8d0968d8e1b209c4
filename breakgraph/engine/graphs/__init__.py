"""The engine's CUDA graph banks (decode, prefill, the bounded-prefill tail) and the one
dispatcher that decides which of them a step replays."""
