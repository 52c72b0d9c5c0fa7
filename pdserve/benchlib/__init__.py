"""The serving benchmark behind ``pdserve bench``: workloads, load generation, figures, plots."""
