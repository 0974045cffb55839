"""Reference models and their exports.

- `blocks`: small hand-written MLP / BERT / GPT-2 / Llama / ViT blocks, `REFERENCE_MODELS`, `EXPECTED_FUSIONS`.
- `export`: torch.export and both ONNX exporters with dynamic ("batch", "seq") dims; the demo's example model.
- `hf`: tiny random-weight Hugging Face BERT / GPT-2 / Llama (needs the `transformers` test extra).
"""
