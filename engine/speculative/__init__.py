"""Speculative decoding: a row's next tokens drafted cheaply, verified by the model in one
forward (``design/032-speculative.md``)."""
