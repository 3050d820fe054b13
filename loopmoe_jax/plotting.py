"""matplotlib's pyplot on the Agg backend (files only, no display): every PNG the package
writes goes through `pyplot()`, imported when a plot is made."""
from __future__ import annotations


def pyplot():
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt
