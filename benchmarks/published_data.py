"""Published figures and the length statistics the published settings use.

FlexSP (Wang et al., ASPLOS'25, arXiv 2412.01523): per-setting speedups of
FlexSP over DeepSpeed-Ulysses and over Megatron-LM, read off the paper's main
result figure (Fig. "End-to-end evaluation ... across three datasets", also
``figs/main-result.jpg`` of PKU-DAIR/Hetu-Galvatron, branch ``flexsp``); the
all-to-all shares from its text as the issue quotes them.  Zeppelin
(EuroSys'26, arXiv 2509.21841): the abstract's average and the maximum over
TransformerEngine CP.
"""

from __future__ import annotations

import numpy as np

K = 1024

#: (model, max length, dataset) -> (FlexSP over DeepSpeed, FlexSP over Megatron-LM).
FLEXSP_SPEEDUPS: dict[tuple[str, int, str], tuple[float, float]] = {
    ("gpt-7b", 192 * K, "GitHub"): (1.45, 1.43),
    ("gpt-7b", 192 * K, "CommonCrawl"): (1.50, 1.66),
    ("gpt-7b", 192 * K, "Wikipedia"): (1.72, 1.98),
    ("gpt-7b", 384 * K, "GitHub"): (1.26, 1.47),
    ("gpt-7b", 384 * K, "CommonCrawl"): (1.42, 1.77),
    ("gpt-7b", 384 * K, "Wikipedia"): (1.46, 1.77),
    ("gpt-13b", 192 * K, "GitHub"): (1.40, 1.38),
    ("gpt-13b", 192 * K, "CommonCrawl"): (1.35, 1.55),
    ("gpt-13b", 192 * K, "Wikipedia"): (1.59, 1.79),
    ("gpt-13b", 384 * K, "GitHub"): (1.29, 1.63),
    ("gpt-13b", 384 * K, "CommonCrawl"): (1.37, 1.70),
    ("gpt-13b", 384 * K, "Wikipedia"): (1.43, 1.77),
    ("gpt-30b", 192 * K, "GitHub"): (1.44, 1.44),
    ("gpt-30b", 192 * K, "CommonCrawl"): (1.54, 1.58),
    ("gpt-30b", 192 * K, "Wikipedia"): (1.64, 1.95),
    ("gpt-30b", 384 * K, "GitHub"): (1.22, 1.40),
    ("gpt-30b", 384 * K, "CommonCrawl"): (1.33, 1.60),
    ("gpt-30b", 384 * K, "Wikipedia"): (1.53, 1.85),
}
#: Share of DeepSpeed-Ulysses' (SP=64) step in all-to-all at most, and FlexSP's.
FLEXSP_ALLTOALL_SHARE = {"ulysses_sp": 0.40, "flexsp": 0.10}
#: Zeppelin over TransformerEngine CP: average and maximum over all settings.
ZEPPELIN_SPEEDUP = {"mean": 2.80, "max": 6.60}

#: Quantiles of the Wikipedia token lengths FlexSP samples from
#: (``galvatron/datasets/wikipedia.txt`` of Hetu-Galvatron's ``flexsp`` branch,
#: 1,000,000 lengths, mean 1,014, max 1,823,777) at :data:`WIKIPEDIA_P`.  The
#: GitHub and CommonCrawl files are not in the repository snapshot we read
#: (Git LFS pointers without content), and the paper's text gives no statistics
#: of them, so those datasets are not synthesized.
WIKIPEDIA_P = np.concatenate([np.arange(100) / 100, 0.99 + np.arange(1, 10) / 1e3,
                              0.999 + np.arange(1, 10) / 1e4, 0.9999 + np.arange(1, 10) / 1e5, [1.0]])
WIKIPEDIA_Q = np.array([
    1, 39, 48, 56, 62, 67, 72, 76, 80, 84, 87, 90, 93, 96, 99, 103, 106, 110, 113, 117, 122, 126, 131,
    136, 141, 146, 151, 155, 160, 165, 171, 177, 183, 190, 198, 205, 213, 220, 228, 235, 243, 251, 260,
    269, 279, 290, 300, 310, 322, 334, 347, 359, 372, 385, 398, 411, 423, 434, 446, 459, 472, 487, 502,
    518, 535, 556, 577, 601, 628, 656, 685, 716, 749, 783, 821, 862, 904, 939, 984, 1035, 1092, 1152,
    1218, 1292, 1373, 1464, 1562, 1670, 1796, 1941, 2112, 2319, 2565, 2862, 3235, 3720, 4392, 5390,
    7087, 10919, 11592, 12343, 13294, 14413, 15986, 18168, 21178, 26511, 37353, 39218, 41801, 44605,
    48258, 51510, 56953, 64182, 75413, 101537, 105242, 111507, 119006, 122865, 129653, 148328, 177821,
    193461, 230941, 1823777])


def sample_wikipedia(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths drawn from the quantile table (inverse CDF, log-linear
    between quantiles)."""
    u = rng.random(n)
    return np.maximum(1, np.rint(np.exp(np.interp(u, WIKIPEDIA_P, np.log(WIKIPEDIA_Q))))).astype(np.int64)
