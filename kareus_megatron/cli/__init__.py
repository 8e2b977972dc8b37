"""kareus_megatron.cli."""
