"""Chaos runner: a lighthouse and torchrun replica groups trained under seeded faults, checked.

The groups are real torchrun jobs running a training script
(examples/train_ddp.py unless --script names another).

    python -m tools.chaos --groups 3 --nproc-per-group 2 --steps 400 --faults 20

Faults (schedule.py): SIGKILL of a whole group, SIGKILL of one rank,
SIGSTOP/SIGCONT of a group, SIGKILL and restart of the lighthouse on the same
port; and, with --correlated, what a rack failing does: two groups at once, a
second group as the survivors reconfigure without the first, a rank in each of
two groups, the lighthouse while a restarted group heals. Faults may
overlap: a group fault fires once another group is healthy to survive it, a
lighthouse fault once every group is; each has healed when every victim has
committed again. At the end it checks (checks.py, report.py)
that the groups of the last quorum hold bit-identical state, that no step went
backwards, that nothing hung and that every child process is gone, and prints
goodput and a per-fault table of survivor stalls and rejoin times. Exits 1
when a check fails; Ctrl-C or any error kills every child.

Modules: cli.py (options, the run's life), runner.py (the loop: logs, faults,
stop), children.py (starting and killing the processes, the script's
contract), report.py (verdict and summary.json), and the pure schedule.py and
checks.py. Nothing is re-exported: the command line is the interface, and the
pure modules import without psutil.
"""
