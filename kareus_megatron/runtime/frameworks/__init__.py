"""Framework patches and entry points: megatron-core and DeepSpeed schedule patches, the flags and
session start shared by every entry point, Megatron-LM's writers, the CPU shim."""
