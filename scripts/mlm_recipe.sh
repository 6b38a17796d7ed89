# The Megatron-LM recipes of the GPU scripts (sourced by scripts/gpu_megatron_lm.sh and
# scripts/gpu_launch_check.sh): Megatron's arguments without Apex/Transformer Engine (COMMON),
# the tiny GPT (TINY), our flags (OURS) and the resume switch (RESUME); mlm_ready checks what a
# run needs.
COMMON=(--transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion
  --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion
  --attention-backend unfused --mock-data --tokenizer-type NullTokenizer
  --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1
  --clip-grad 1.0 --seed 1234 --log-interval 1 --eval-iters 0 --eval-interval 100000
  --split 100,0,0 --ckpt-format torch_dist)
TINY=(--num-layers 2 --hidden-size 256 --num-attention-heads 4
  --seq-length 256 --max-position-embeddings 256 --vocab-size 1024
  --micro-batch-size 4 --global-batch-size 4)
OURS=(--async-save --use-persistent-ckpt-worker --async-ckpt-use-cpu-shm
  --ckpt-assume-constant-structure --dist-ckpt-workers 1)
RESUME=(--exit-on-missing-checkpoint)

# mlm_ready: the carried Megatron-LM files are there (else say which, return 1); megatron.training
# runs `make` in megatron/core/datasets at start-up and the wheel ships the built helper only.
mlm_ready() {
  local f ds
  for f in pretrain_gpt.py gpt_builders.py model_provider.py; do
    [ -f ".mlm/$f" ] || { echo "missing .mlm/$f: carry .mlm (see docs/MEGATRON_LM.md)"; return 1; }
  done
  ds=$(python3 -c "import importlib.util as u, os; s=u.find_spec('megatron'); print(os.path.join(list(s.submodule_search_locations)[0], 'core', 'datasets'))")
  if [ -d "$ds" ] && [ ! -f "$ds/Makefile" ]; then printf 'all:\n\t@true\n' > "$ds/Makefile"; fi
}
