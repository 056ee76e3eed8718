"""The evaluation command line (the logic is :mod:`verl_ext.eval.run`):

    python -m recipe.gepo.evaluate model_path=/path/to/hf_or.gguf \\
        benchmarks=[amc23,aime24,aime25,math500] samples_per_problem=8 output_dir=outputs/eval/run1

Settings: ``config/evaluate.yaml`` beside this file, mirrored by
:class:`verl_ext.eval.run.EvalConfig` (every field documented there).
"""

from __future__ import annotations


def main() -> None:
    import hydra
    from omegaconf import OmegaConf

    from verl_ext.eval.run import config_from_mapping, run_evaluation

    @hydra.main(config_path="config", config_name="evaluate", version_base=None)
    def _entry(dcfg) -> None:
        run_evaluation(config_from_mapping(OmegaConf.to_container(dcfg, resolve=True)))

    _entry()


if __name__ == "__main__":
    main()
