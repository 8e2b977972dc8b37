"""The validation kit's runtime checks (``python -m kareus_megatron.runtime.selfcheck.checks``)."""
