"""Every flag `k3 train`, `k3 rl`, `k3 sft`, `k3 distill`, `k3 serve`, `k3 generate` and `k3 chat` took before their
flags were generated from the config dataclasses still exists, so no user's command or documented example breaks."""

from __future__ import annotations

import pytest

from k3.cli import build_parser

# `k3 COMMAND --help` before k3.cli_config generated them.
FLAGS_BEFORE = {
    "train": "--allow-image-paths-outside --batch-size --checkpoint-format --cuda-graph --data --device --dtype "
             "--eager --ep --ep-balanced --eval-batches --eval-every --global-batch --grad-clip --help "
             "--image-fraction --log-every --lr --master-weights --max-corpus-mb --max-image-bytes "
             "--max-image-patches --max-image-pixels --max-steps --out --preset --profile --profile-at "
             "--qb-aggregate --qb-iters --recall-fraction --recall-length --recall-pairs --recall-queries "
             "--recall-weight --resume --save-every --seed --seq-len --seq-len-schedule --skip-bad-images --threads "
             "--time-budget-s --tokenizer --val-fraction --vision --vision-lr --vision-train --warmup-steps "
             "--weight-decay -h",
    "generate": "--chat --device --dtype --escapes --help --image --max-context --max-new-tokens --model --no-stream "
                "--prompt --prompts-file --run --seed --stop-token --temperature --top-k --top-p -h",
    "rl": "--algo --clip-high --clip-low --count --device --from --group --heldout-every --heldout-samples "
          "--heldout-tasks --help --iteration-token-budget --json --kl-coef --lr --max-context --minibatches "
          "--no-routing-replay --no-tis --out --ray --refill-rounds --resume --rollout-dtype --rollout-worker-cpus "
          "--rollout-worker-gpus --rollout-workers --routing-source --run --sandbox-backend --save-every --seed "
          "--steps --suite --tasks-per-step --tau --temperature --threads --tis-cap --tool-budget -h",
    "chat": "--device --dtype --help --max-context --max-new-tokens --model --run --seed --stop-token --temperature "
            "--top-k --top-p -h",
    "distill": "--algo --baseline --data --device --estimator --heldout-every --heldout-prompts --heldout-samples "
               "--help --json --lr --lr-schedule --max-context --max-new-tokens --mixed-weight --mode --out "
               "--prompt-tokens --prompts-per-domain --reference-tokens --resume --rl-suite --samples --save-every "
               "--seed --steps --student --suite-tasks --teacher --temperature --threads --tis-cap --top-k -h",
    "sft": "--allow-image-paths-outside --batch-size --data --device --help --lr --max-image-bytes "
           "--max-image-patches --max-image-pixels --out --resume --run --save-every --seed --skip-bad-images "
           "--steps --threads --vision --vision-lr --vision-train -h",
    "serve": "--allowed-hosts --allowed-origins --api-key --chat-template --device --dtype --header-timeout --help "
             "--host --keep-alive-timeout --keep-serving-after-engine-error --log-level --max-batch --max-body-mb "
             "--max-connections --max-context --max-queue --model --no-prefix-cache --no-warmup --port --run "
             "--served-model-name -h",
}


def command_parser(name: str):
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return subparsers.choices[name]


@pytest.mark.parametrize("command", sorted(FLAGS_BEFORE))
def test_every_earlier_flag_still_exists(command: str) -> None:
    now = {flag for action in command_parser(command)._actions for flag in action.option_strings}
    missing = set(FLAGS_BEFORE[command].split()) - now
    assert not missing, f"k3 {command} lost {sorted(missing)}"


@pytest.mark.parametrize("command", sorted(FLAGS_BEFORE))
def test_help_lists_every_flag(command: str) -> None:
    parser = command_parser(command)
    text = parser.format_help()  # raises on a help string argparse cannot format (a bare %)
    missing = [flag for action in parser._actions for flag in action.option_strings if flag not in text]
    assert not missing


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_share_serves_engine_flags(command: str) -> None:
    """Their model and engine flags are serve's, built from the same fields (the same help), less what the command
    decides itself (generate: no prefix cache; chat: one conversation)."""
    def helps(name):
        return {flag: action.help for action in command_parser(name)._actions for flag in action.option_strings}

    serve, mine = helps("serve"), helps(command)
    shared = {"--run", "--model", "--device", "--dtype", "--max-context"}
    assert all(mine[flag] == serve[flag] for flag in shared)
    assert ("--max-batch" in mine) == (command == "generate")
    assert ("--no-prefix-cache" in mine) == (command == "chat")
