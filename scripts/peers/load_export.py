"""Load this project's exported drafter with a peer's own loader, run with the peer's python; prints one JSON line.

    <venv>/bin/python scripts/peers/load_export.py specforge|speculators EXPORT_DIR TARGET_DIR

Every tensor the peer's model holds is compared with the file's (max abs difference); keys on one side only are
listed. speculators loads a DFlash export through its own converter (from_pretrained with a verifier); SpecForge
through AutoDraftModel, as its trainer's draft_checkpoint_path warm start does.
"""
import json
import sys

from safetensors.torch import load_file


def specforge_state(export: str, target: str) -> dict:
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import load_draft_config_source

    model = AutoDraftModel.from_pretrained(export, config=load_draft_config_source(export))
    return model.state_dict()


def speculators_state(export: str, target: str) -> dict:
    from speculators.models.dflash import DFlashDraftModel

    model = DFlashDraftModel.from_pretrained(export, verifier=target)
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("verifier_", "embed_tokens", "lm_head"))}


def main() -> None:
    peer, export, target = sys.argv[1:4]
    state = {"specforge": specforge_state, "speculators": speculators_state}[peer](export, target)
    ours = load_file(f"{export}/model.safetensors")
    shared = sorted(set(ours) & set(state))
    diff = max((float((state[k].float() - ours[k].float()).abs().max()) for k in shared), default=None)
    print(json.dumps({"peer": peer, "loaded": len(shared), "max_abs_diff": diff,
                      "only_in_export": sorted(set(ours) - set(state)),
                      "only_in_peer_model": sorted(set(state) - set(ours))}))


if __name__ == "__main__":
    main()
