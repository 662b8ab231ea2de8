#!/usr/bin/env bash
# verl's own PPO trainer with the gradloc node: a tiny random Qwen2, a tiny parquet made here, one
# injected culprit, the spike table and block left in DIR/run (docs/verl.md says what ran where).
#
#   bash examples/verl_main_ppo.sh [DIR]        # in the [verl] venv (docs/verl.md); DIR: runs/verl_main_ppo
#   MLFLOW_TRACKING_URI=sqlite:///$PWD/mlflow.db bash examples/verl_main_ppo.sh   # also into one MLflow run
#
# With a GPU and vLLM: `python -m verl.trainer.main_ppo` end to end (rollout on vLLM, the marked
# prompt's reward NaN). Without: verl's rollout cannot run (vLLM/SGLang/TensorRT-LLM servers only),
# so the trainer's path from the rollout on runs on CPU: Ray as main_ppo starts it, verl's actor
# workers (FSDP2, 2 processes), the trainer's own old-log-prob, GRPO-advantage and update methods,
# responses from transformers' generate standing in for the rollout, one reward outlier.
set -euo pipefail
DIR="${1:-runs/verl_main_ppo}"
HERE="$(cd "$(dirname "$0")" && pwd)"
export WANDB_MODE="${WANDB_MODE:-offline}"
rm -rf "$DIR/run" "$DIR/ledger"
python "$HERE/verl_main_ppo.py" prepare "$DIR"
if nvidia-smi -L >/dev/null 2>&1 && python -c "import vllm" >/dev/null 2>&1; then
  LOGGER="[console]"
  if [ -n "${MLFLOW_TRACKING_URI:-}" ]; then LOGGER="[console,mlflow]"; fi
  # shellcheck disable=SC2046  # the overrides are words
  python -m verl.trainer.main_ppo $(python "$HERE/verl_main_ppo.py" overrides "$DIR") \
    actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.3 trainer.total_training_steps=4 \
    trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 "trainer.logger=$LOGGER"
else
  echo "no GPU with vLLM here: running verl's trainer path on CPU without its rollout (docs/verl.md)"
  python "$HERE/verl_main_ppo.py" workers "$DIR"
fi
python "$HERE/verl_main_ppo.py" check "$DIR"
