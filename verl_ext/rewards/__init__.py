"""Rewards: math_verify accuracy + format terms (:mod:`.math_reward`), the toy task's exact match
(:mod:`.toy_reward`), boxed-answer extraction (:mod:`.extract`) and the verification process pool
(:mod:`.verify_pool`). Importing this package starts no process."""
