"""The `kareus` command line: one thin module per subcommand (never the runtime).

- main.py: the `kareus` command, its subcommand table and the one error boundary.
- parsing.py: the argument parser every command uses (a usage error is one line, exit status 2).
- workload_args.py: the workload flags every subcommand shares (--gpu, --model, the layout, --calibration).
- env.py: `kareus env`, what this machine offers the runtime.
- predict.py: `kareus predict`, per-stage time, energy and power at each SM clock.
- calibrate.py: `kareus calibrate`, fit the kernel model to a profile or to microbenchmarks.
- partitions.py: `kareus partitions`, each nanobatch partition's frontier and chosen knobs.
- plan.py: `kareus plan`, the time–energy frontier of every method, written as plan files.
- solve.py: `kareus solve`, the frontier of a measured Perseus-format profile.
- launch.py: `kareus launch`, run a plan directory's points (torchrun or Slurm).
- torchrun.py: `kareus torchrun`, torchrun ending with one line and exit status 2 on a kareus error.
- validate.py: `kareus validate`, the GPU validation kit on one GPU, or a CPU dry run.
- report.py: `kareus report`, a run's measured against predicted time and energy.
- compare.py: `kareus compare`, the reductions table and frontier plot of measured runs.
"""
