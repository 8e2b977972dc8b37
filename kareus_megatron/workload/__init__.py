"""kareus_megatron.workload."""
