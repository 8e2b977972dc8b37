"""kareus_megatron.search."""
