"""What every minirl process does as it starts and as it ends: the garbage collector's pace until
its engine is built (collector.py), and the exit without the interpreter's teardown once its work
is done (quick_exit.py)."""
