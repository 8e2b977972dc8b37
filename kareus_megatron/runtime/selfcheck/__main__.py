"""``python -m kareus_megatron.runtime.selfcheck``: the runtime checks (checks.py)."""

from kareus_megatron.runtime.selfcheck.checks import main

if __name__ == "__main__":
    raise SystemExit(main())
