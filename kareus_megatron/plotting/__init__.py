"""kareus_megatron.plotting."""
