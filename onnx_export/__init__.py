"""Export decoder models to ONNX (Hugging Face through PyTorch, or the dependency-free synthetic generator)."""
