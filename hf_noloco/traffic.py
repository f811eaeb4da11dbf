"""``python -m hf_noloco.traffic``: the traffic table (:mod:`hf_noloco.estimate.traffic`)."""

from hf_noloco.estimate.traffic import main

if __name__ == "__main__":
    main()
