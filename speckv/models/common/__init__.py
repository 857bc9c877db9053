"""What every model family shares: the HF-config shapes (`ModelConfig`), layers, RoPE, the KV
cache layout, the decoder tail, weight loading, the tokenizer and random init."""
