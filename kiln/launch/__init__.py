"""Starting a job on several processes: torchrun on one node (torchrun.py) and cluster launchers."""
