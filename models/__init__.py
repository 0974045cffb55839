"""Reference models and their exports (installed as tkopt.models).

- `blocks`: small hand-written MLP / BERT / GPT-2 / Llama / ViT blocks, `REFERENCE_MODELS`, `EXPECTED_FUSIONS`.
- `export`: torch.export and both ONNX exporters with dynamic ("batch", "seq") dims; the demo's example model.
- `hf`: tiny random-weight Hugging Face BERT / GPT-2 / Llama (needs the `transformers` test extra).
"""

if __name__ != "tkopt.models":  # imported by its folder's name, from a checkout's root on sys.path
    raise ImportError(f"{__file__} (tkopt.models) was imported as `{__name__}`: Python started in a tkopt checkout's "
                      f"root, whose models/ folder hides any installed `{__name__}` package (transformers >= 5 "
                      "imports the hub's `kernels`). Run Python from another folder.")
