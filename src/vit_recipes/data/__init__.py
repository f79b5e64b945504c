"""Images to batches: a dataset (the Hub's, a local folder indexed in one walk, parquet, save_to_disk) to labelled
splits (data, folder_index), any image to RGB uint8 (images), decoded once into a disk copy or per batch in the
DataLoader workers (decoding), --streaming's per-rank streams (streaming), augmentation on the device (transforms),
and the Trainer's bases that feed it batches (batches, streaming). It may import core/ only."""
