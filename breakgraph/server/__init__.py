"""The API process: the HTTP routes (SGLang-native and OpenAI), request validation, and the
handle on the engine process (whose loop is engine_process.py)."""
