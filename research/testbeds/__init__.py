"""Test beds on one Linux box: a real rate-limited link and a two-node Ray cluster (``wan/``,
docs/network.md) and a SLURM cluster of network-namespace nodes (``slurm_cluster.py``,
docs/scale-out.md) that the sbatch files of ``scripts/slurm/`` run on unmodified."""
