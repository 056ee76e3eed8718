"""SLURM: the sbatch scripts and a local cluster of network-namespace nodes to run them on."""
