"""kareus_megatron.hardware.device."""
