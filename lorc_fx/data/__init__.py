"""Loading what the project runs on without network: models (the embedded SmolLM2, local
directories, GGUF files), real English text, and the R serialization reader behind the
Austen novels."""
