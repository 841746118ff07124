"""A reward whose module takes IMPORT_S to import: a reward process's start, made slow on demand."""
import time

IMPORT_S = 1.5
time.sleep(IMPORT_S)


def quick(prompt, completion, row):
    return 1.0
