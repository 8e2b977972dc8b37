"""kareus_megatron.cost."""
