"""cufa inside other libraries: ``cufa.integrations.transformers`` makes cufa an attention
backend of Hugging Face transformers. Each module here sits on top of cufa, calls its
public functions only, and is imported on its own (``import cufa`` does not import it)."""
