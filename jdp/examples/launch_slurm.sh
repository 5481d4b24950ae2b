#!/usr/bin/env bash
# jdp on a SLURM cluster: one process per node, each using all of its GPUs.
#   sbatch launch_slurm.sh char_gpt     (python -m jdp.examples prints this file's folder)
# jax.distributed.initialize() reads SLURM's environment (nodes, task ids, the first node as
# coordinator), so no --coordinator is needed. SLURM sends SIGTERM before a preemption; jdp then
# saves one checkpoint on all processes and exits 0, and resubmitting the job resumes it.
#SBATCH --job-name=jdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --signal=TERM@120
#SBATCH --requeue
set -euo pipefail
config=${1:-char_gpt}  # a shipped config's name, or a file
srun jdp train "$config" --workdir "runs/slurm_${SLURM_JOB_NAME}" --auto-distributed --no-progress
