"""Models: loading any local Hugging Face model (``loading``) on a device and dtype (``devices``), and the tiny
offline models built from nothing (``tiny``, ``tiny_vision``, their tokenizer trainer ``offline_tokenizer``)."""
