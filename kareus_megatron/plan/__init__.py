"""Plan files: what the planner writes and the runtime executes.

- schema.py: the plan file, ``kareus-plan/1``.
- megatron_model.py: how Megatron-LM and megatron-core spell a plan's model record.
- environment.py: the environment variables a plan's framework requires of the job.
- build.py: a planning run turned into plan files and the frontier document.
- io.py: load (validating every field) and save plan files; JSON Schema export.
- frontier.py: the frontier file, ``kareus-frontier/1``, and the reductions against the baselines.
- points.py: a plan directory's points (the one ``frontier.json`` reader and point syntax).
- objective.py: what an automatically chosen plan optimises, and the frontier point that meets it.
- workload.py: a plan's own workload, rebuilt from its record.
- evaluate.py: a plan's iteration time and energy under a given kernel model.
- power.py: a plan's predicted power waveform, from the plan file alone.
"""
