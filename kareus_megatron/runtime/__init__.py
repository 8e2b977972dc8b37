"""kareus_megatron.runtime."""
