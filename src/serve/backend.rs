//! Where the queue and history live: in this process ([`Queue`], the
//! default), or in Redis for a cluster of API processes and `sdkit worker`s
//! ([`Store`]). Routes see one interface; a Redis that cannot be reached
//! makes a route answer 503 with the reason, and loses nothing queued.

use super::cluster::Store;
use super::queue::{Item, Queue};
use serde_json::Value as Json;
use std::sync::Arc;

pub enum Backend {
    Local(Arc<Queue>),
    Redis(Arc<Store>),
}

/// A queue operation that failed (only the Redis store fails).
pub type QResult<T> = Result<T, String>;

fn redis_err(e: redis::RedisError) -> String {
    format!("the queue's Redis failed: {e}")
}

impl Backend {
    pub async fn number(&self, given: Option<f64>, front: bool) -> QResult<f64> {
        match self {
            Backend::Local(q) => Ok(q.number(given, front)),
            Backend::Redis(s) => s.number(given, front).await.map_err(redis_err),
        }
    }

    /// Queues `item`; `models` (its large model files) steer a cluster's
    /// dispatch. An error refuses the prompt.
    pub async fn push(&self, item: Item, models: Vec<String>) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                q.push(item);
                Ok(())
            }
            Backend::Redis(s) => s.push(&item, &models).await,
        }
    }

    /// `{"exec_info": {"queue_remaining": N}}`.
    pub async fn info(&self) -> QResult<Json> {
        match self {
            Backend::Local(q) => Ok(q.info()),
            Backend::Redis(s) => s.info().await.map_err(redis_err),
        }
    }

    pub async fn to_json(&self) -> QResult<Json> {
        match self {
            Backend::Local(q) => Ok(q.to_json()),
            Backend::Redis(s) => s.to_json().await.map_err(redis_err),
        }
    }

    pub async fn clear_pending(&self) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                q.clear_pending();
                Ok(())
            }
            Backend::Redis(s) => s.delete_pending(None).await.map_err(redis_err),
        }
    }

    pub async fn delete_pending(&self, ids: &[String]) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                q.delete_pending(ids);
                Ok(())
            }
            Backend::Redis(s) => s.delete_pending(Some(ids)).await.map_err(redis_err),
        }
    }

    /// Interrupts the running prompt `prompt_id`, or every running one.
    pub async fn interrupt(&self, prompt_id: Option<&str>) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                q.interrupt(prompt_id);
                Ok(())
            }
            Backend::Redis(s) => s.interrupt(prompt_id).await.map_err(redis_err),
        }
    }

    /// The running prompt of `client` and the node it is at.
    pub async fn running_for(&self, client: &str) -> Option<(String, Option<String>)> {
        match self {
            Backend::Local(q) => q.running_for(client),
            Backend::Redis(s) => s.running_for(client).await,
        }
    }

    pub async fn history(&self, max_items: Option<usize>, offset: Option<usize>) -> QResult<Json> {
        match self {
            Backend::Local(q) => Ok(q.history(max_items, offset)),
            Backend::Redis(s) => s.history(max_items, offset).await.map_err(redis_err),
        }
    }

    pub async fn history_one(&self, prompt_id: &str) -> QResult<Json> {
        match self {
            Backend::Local(q) => Ok(q.history_one(prompt_id)),
            Backend::Redis(s) => s.history_one(prompt_id).await.map_err(redis_err),
        }
    }

    pub async fn job_records(&self) -> QResult<Vec<Json>> {
        match self {
            Backend::Local(q) => Ok(q.job_records()),
            Backend::Redis(s) => s.job_records().await.map_err(redis_err),
        }
    }

    pub async fn job_detail(&self, id: &str) -> QResult<Option<Json>> {
        match self {
            Backend::Local(q) => Ok(q.job_detail(id)),
            Backend::Redis(s) => s.job_detail(id).await.map_err(redis_err),
        }
    }

    pub async fn delete_history(&self, ids: Option<&[String]>) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                match ids {
                    None => q.clear_history(),
                    Some(ids) => q.delete_history(ids),
                }
                Ok(())
            }
            Backend::Redis(s) => s.delete_history(ids).await.map_err(redis_err),
        }
    }

    /// `/free`: applied by every worker between prompts.
    pub async fn request_free(&self, unload_models: bool, free_memory: bool) -> QResult<()> {
        match self {
            Backend::Local(q) => {
                q.request_free(unload_models, free_memory);
                Ok(())
            }
            Backend::Redis(s) => s
                .request_free(unload_models, free_memory)
                .await
                .map_err(redis_err),
        }
    }
}
