"""kareus_megatron.hardware."""
