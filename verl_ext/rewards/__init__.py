"""Rewards: math_verify accuracy + format terms (:mod:`.math_reward`), the toy task's exact match
(:mod:`.toy_reward`) and its long-answer form (:mod:`.scratchpad_reward`), the registry that picks
one by ``data_source`` (:mod:`.dispatch`, the one router), boxed-answer extraction
(:mod:`.extract`) and the verification process pool (:mod:`.verify_pool`). Importing this package
starts no process."""
