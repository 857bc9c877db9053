"""The Gemma family: Gemma 3 and Gemma 4 text decoders, their loader, and the tiny random-init
`hybrid-swa` model."""
