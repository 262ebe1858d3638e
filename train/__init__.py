"""Training: the LightningModule (loss, metrics, optimizer), the data module over the feature store,
and the run wiring."""
