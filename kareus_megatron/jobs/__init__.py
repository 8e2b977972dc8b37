"""Cluster jobs for a plan directory (``kareus launch``): the exact commands of each run, and the flow that
starts them, writes their manifests and compares the measured logs.

May import plan, workload, report and vocab; never runtime, search or torch, so a submit host needs only
the core package.
"""
