"""Data: interleaved rank sharding, in-memory and HDF5 datasets, a batch loader, built-in sets.

    sampler = ht.data.ShardedSampler(len(ds), comm.rank, comm.size, seed=0, pad="mask")
    loader = ht.data.DataLoader(ds, batch_size=32, sampler=sampler, prefetch=True)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for x, y, w in loader: ...
"""

from .datasets import ArrayDataset, HDF5Dataset, TokenDataset
from .loader import DataLoader
from .sampler import ShardedSampler

__all__ = ["ArrayDataset", "DataLoader", "HDF5Dataset", "ShardedSampler", "TokenDataset"]
