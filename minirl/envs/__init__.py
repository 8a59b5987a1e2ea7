"""Environments: what an environment is to minirl, and how one runs.

    contract.py      the shape minirl speaks (OpenEnv's): `reset`, `step`, `close`; the action a call
                     becomes; the arguments a method is given (only those its signature takes)
    observations.py  every observation a user's environment returns, read into the text the model
                     reads, whether it is a tool error, `done` and the reward; or refused naming its type
    formats.py       how a call is written in a turn and a reply in the next: the scaffold kept whole,
                     a long reply cut with a marker, environment text never forging special tokens
    hosting.py       where each environment lives for its lifetime: one worker (a thread with its own
                     event loop, or a process of its own), a cap on environments alive at once, a
                     time limit on every call, a hung call's environment closed once it returns
    outcome.py       what a step and an evaluation train or score of an episode: its answer, its R,
                     or nothing (a fault of the environment is never a sample of the model)

The turn loop that drives them stays with the rollouts (minirl/rollout/episodes.py); it sees one small
interface: start an episode, act, read a reply, close. Torch-free: the CLI and the validator import it.

May import: the top-level modules and proc. Must not import any other room of minirl.
"""
