#!/usr/bin/env bash
# jdp on a SLURM cluster: one process per node, each using all of its GPUs.
#   sbatch examples/launch_slurm.sh configs/char_gpt.yaml
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
config=${1:-configs/char_gpt.yaml}
srun jdp train "$config" --workdir "runs/slurm_${SLURM_JOB_NAME}" --auto-distributed --no-progress
