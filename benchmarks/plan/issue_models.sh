# The three `kvram plan` commands of the issue "kvram plan answers in a minute", by name: sourced by
# benchmarks/plan/minute.sh and check_passes.sh. `plan_args NAME` sets the array `args` to the
# command's model arguments (the rest, --classes 1000 --limit-gpu, is the caller's).
plan_args() {
  case $1 in
    resnet50) args=(--model ResNet50 --input-shape 224,224,3 --batch-size 256 --gpu-memory 8GB) ;;
    vit_b16) args=(--model models.vit:vit_b16_plain --batch-size 256 --gpu-memory 12GB) ;;
    convnext_small) args=(--model ConvNeXtSmall --input-shape 224,224,3 --batch-size 128 --gpu-memory 12GB) ;;
    *) echo "unknown model $1 (resnet50, vit_b16, convnext_small)" >&2; return 2 ;;
  esac
}
