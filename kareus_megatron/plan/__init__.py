"""kareus_megatron.plan."""
