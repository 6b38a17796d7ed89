# The Megatron-LM recipes of the GPU scripts (sourced by scripts/gpu_megatron_lm.sh and
# scripts/gpu_launch_check.sh): Megatron's arguments without Apex/Transformer Engine (COMMON),
# the tiny GPT (TINY), our flags (OURS) and the resume switch (RESUME); mlm_model gives the step
# scripts' larger models; mlm_ready checks what a run needs.
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

# mlm_model MODEL: the step scripts' model shapes (134m, 1b) in MARGS and their save interval in
# EVERY (each write ends before the next save); 1b keeps the latest checkpoint only.
mlm_model() {
  case $1 in
    134m) MARGS=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
                 --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 4
                 --global-batch-size 4); EVERY=100 ;;
    1b)   MARGS=(--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --seq-length 1024
                 --max-position-embeddings 1024 --vocab-size 32000 --micro-batch-size 2
                 --global-batch-size 2 --save-retain-interval 130000); EVERY=130 ;;
    *) echo "mlm_model: no model $1 (134m or 1b)"; return 1 ;;
  esac
}

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
