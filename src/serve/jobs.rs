//! ComfyUI's jobs API (`GET /api/jobs`, `GET /api/jobs/{id}`), which newer
//! front ends read instead of `/queue` and `/history`: one flat record per
//! prompt (pending, in_progress, completed, failed, cancelled) with its
//! times, first previewable output, output count and error, in pages.

use super::queue::{number_json, Item};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

const STATUSES: &[&str] = &["pending", "in_progress", "completed", "failed", "cancelled"];
/// Output lists a job's preview may come from, in the front end's terms.
const MEDIA: &[&str] = &["images", "video", "audio", "gifs", "3d"];

/// A queued or running prompt as a job record; `detail` adds what only
/// `/api/jobs/{id}` returns (the workflow, outputs).
pub fn from_item(item: &Item, status: &str, started_ms: Option<u64>, detail: bool) -> Json {
    let mut job = common(
        &item.prompt_id,
        status,
        number_json(item.number),
        &item.extra_data,
    );
    job.insert("execution_start_time".into(), json!(started_ms));
    job.insert("execution_end_time".into(), Json::Null);
    job.insert("preview_output".into(), Json::Null);
    job.insert("outputs_count".into(), json!(0));
    job.insert("execution_error".into(), Json::Null);
    if detail {
        job.insert(
            "workflow".into(),
            json!({"prompt": item.prompt, "extra_data": item.extra_data}),
        );
        job.insert("outputs".into(), json!({}));
    }
    Json::Object(job)
}

/// A history entry (`{prompt: [number, id, prompt, extra_data, outputs],
/// outputs, status, meta}`) as a job record; `detail` adds what only
/// `/api/jobs/{id}` returns. The list form clones no prompt or outputs:
/// the front end polls it over the whole history.
pub fn from_history(id: &str, entry: &Json, detail: bool) -> Json {
    let prompt = entry.get("prompt").and_then(Json::as_array);
    let at = |i: usize| prompt.and_then(|p| p.get(i));
    let no_extra = Map::new();
    let extra = at(3).and_then(Json::as_object).unwrap_or(&no_extra);
    let status = entry.get("status").unwrap_or(&Json::Null);
    let messages: Vec<(String, Json)> = status
        .get("messages")
        .and_then(Json::as_array)
        .map(|m| {
            m.iter()
                .filter_map(|pair| {
                    let name = pair.get(0)?.as_str()?.to_string();
                    Some((name, pair.get(1).cloned().unwrap_or(Json::Null)))
                })
                .collect()
        })
        .unwrap_or_default();
    let message = |name: &str| messages.iter().find(|(n, _)| n == name).map(|(_, d)| d);
    let time = |name: &str| message(name).and_then(|d| d.get("timestamp")).cloned();
    let state = if message("execution_interrupted").is_some() {
        "cancelled"
    } else if status.get("status_str").and_then(Json::as_str) == Some("success") {
        "completed"
    } else {
        "failed"
    };
    let end = [
        "execution_success",
        "execution_error",
        "execution_interrupted",
    ]
    .iter()
    .find_map(|n| time(n));
    let outputs = entry.get("outputs").unwrap_or(&Json::Null);
    let (preview, count) = preview_and_count(outputs);
    let mut job = common(id, state, at(0).cloned().unwrap_or(Json::Null), extra);
    job.insert(
        "execution_start_time".into(),
        time("execution_start").unwrap_or(Json::Null),
    );
    job.insert(
        "execution_end_time".into(),
        end.clone().unwrap_or(Json::Null),
    );
    job.insert("preview_output".into(), preview);
    job.insert("outputs_count".into(), json!(count));
    job.insert(
        "execution_error".into(),
        message("execution_error").cloned().unwrap_or(Json::Null),
    );
    if detail {
        job.insert(
            "workflow".into(),
            json!({"prompt": at(2), "extra_data": extra}),
        );
        job.insert(
            "outputs".into(),
            outputs
                .as_object()
                .map_or_else(|| json!({}), |_| outputs.clone()),
        );
        if let Some(end) = end {
            job.insert("update_time".into(), end);
        }
        job.insert("execution_status".into(), status.clone());
        job.insert(
            "execution_meta".into(),
            entry.get("meta").cloned().unwrap_or_else(|| json!({})),
        );
    }
    Json::Object(job)
}

fn common(id: &str, status: &str, number: Json, extra: &Map<String, Json>) -> Map<String, Json> {
    let mut job = Map::new();
    job.insert("id".into(), json!(id));
    job.insert("status".into(), json!(status));
    job.insert(
        "create_time".into(),
        extra.get("create_time").cloned().unwrap_or(json!(0)),
    );
    job.insert(
        "workflow_id".into(),
        extra
            .get("extra_pnginfo")
            .and_then(|p| p.get("workflow"))
            .and_then(|w| w.get("id"))
            .cloned()
            .unwrap_or(Json::Null),
    );
    job.insert("priority".into(), number);
    job
}

/// The first saved (else any) media item of the outputs, tagged with its
/// node and media type, and how many media items there are in all.
fn preview_and_count(outputs: &Json) -> (Json, usize) {
    let mut count = 0;
    let mut first: Option<Json> = None;
    let mut first_saved: Option<Json> = None;
    for (node, out) in outputs.as_object().into_iter().flatten() {
        for media in MEDIA {
            for item in out
                .get(*media)
                .and_then(Json::as_array)
                .into_iter()
                .flatten()
            {
                count += 1;
                let Some(obj) = item.as_object() else {
                    continue;
                };
                let mut p = obj.clone();
                p.insert("nodeId".into(), json!(node));
                p.insert("mediaType".into(), json!(media));
                let saved = obj.get("type").and_then(Json::as_str) == Some("output");
                if saved && first_saved.is_none() {
                    first_saved = Some(Json::Object(p.clone()));
                }
                first.get_or_insert(Json::Object(p));
            }
        }
    }
    (first_saved.or(first).unwrap_or(Json::Null), count)
}

/// `GET /api/jobs`: `status` (comma-separated), `workflow_id`, `sort_by`
/// (`created_at` or `execution_duration`), `sort_order` (`asc`/`desc`,
/// default newest first), `limit`, `offset`. Errors name the bad parameter.
pub fn list(mut jobs: Vec<Json>, query: &HashMap<String, String>) -> Result<Json, String> {
    if let Some(s) = query.get("status").filter(|s| !s.is_empty()) {
        let wanted: Vec<&str> = s.split(',').map(str::trim).collect();
        if let Some(bad) = wanted.iter().find(|w| !STATUSES.contains(w)) {
            return Err(format!(
                "status: unknown value \"{bad}\" (one of {})",
                STATUSES.join(", ")
            ));
        }
        jobs.retain(|j| wanted.contains(&j["status"].as_str().unwrap_or("")));
    }
    if let Some(w) = query.get("workflow_id") {
        jobs.retain(|j| j["workflow_id"].as_str() == Some(w.as_str()));
    }
    let number = |name: &str| -> Result<Option<usize>, String> {
        query
            .get(name)
            .map(|v| {
                v.parse::<usize>()
                    .map_err(|_| format!("{name}: expected a non-negative integer, got \"{v}\""))
            })
            .transpose()
    };
    let limit = number("limit")?;
    let offset = number("offset")?.unwrap_or(0);
    let key: fn(&Json) -> f64 = match query.get("sort_by").map(String::as_str) {
        None | Some("created_at") => |j| j["create_time"].as_f64().unwrap_or(0.0),
        Some("execution_duration") => |j| match (
            j["execution_start_time"].as_f64(),
            j["execution_end_time"].as_f64(),
        ) {
            (Some(s), Some(e)) => e - s,
            _ => 0.0,
        },
        Some(other) => {
            return Err(format!(
                "sort_by: unknown value \"{other}\" (created_at or execution_duration)"
            ))
        }
    };
    let descending = match query.get("sort_order").map(String::as_str) {
        None | Some("desc") => true,
        Some("asc") => false,
        Some(other) => {
            return Err(format!(
                "sort_order: unknown value \"{other}\" (asc or desc)"
            ))
        }
    };
    // Stable sorts: equal keys (prompts queued in the same millisecond)
    // keep queue/history order, reversed for newest first.
    if descending {
        jobs.reverse();
        jobs.sort_by(|a, b| key(b).total_cmp(&key(a)));
    } else {
        jobs.sort_by(|a, b| key(a).total_cmp(&key(b)));
    }
    let total = jobs.len();
    let limit = limit.unwrap_or(total);
    let page: Vec<Json> = jobs.into_iter().skip(offset).take(limit).collect();
    Ok(json!({
        "jobs": page,
        "pagination": {
            "offset": offset,
            "limit": limit,
            "total": total,
            "has_more": offset.saturating_add(limit) < total,
        }
    }))
}
