"""The Llama family (Llama, SmolLM2, Qwen2, Qwen3): the decoder, its safetensors and GGUF
loaders, and the built-in SmolLM2-135M."""
