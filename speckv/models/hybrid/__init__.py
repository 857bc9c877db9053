"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): config, GDN layers, MoE, the decoder, its
loader, and the random-init `hybrid-gdn` model."""
